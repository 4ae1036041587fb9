from kvpage.entrypoints.cli.main import main

raise SystemExit(main())
