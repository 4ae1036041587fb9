"""kvpage census: which decoder families of the installed transformers kvpage serves exactly.

Front-end tooling over ``kvpage.LLM`` (it imports torch and transformers when run):

* ``tiny_config``: a tiny random config for any family, shrunk from its config class's defaults;
* ``compare``: kvpage's greedy tokens against HF ``generate`` in two engine modes;
* ``family``: one family classified as exact, refused, mismatch or skipped;
* ``runner``: every family in its own process under a time limit, results as JSON;
* ``report``: the coverage page (``docs/model_coverage.md``) from that JSON;
* ``check``: the same comparison for one local model folder (``kvpage check``).
"""
