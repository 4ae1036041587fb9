"""Run lm-eval's ``kvpage_mc`` and ``kvpage_gen`` tasks for one or more models in one process.

Usage: ``python run_eval.py TASK_DIR OUT_JSON MODEL MODEL_ARGS [MODEL MODEL_ARGS ...]``.
Writes one entry per MODEL MODEL_ARGS pair, in order: ``[{task: [{"doc_id", "resps"}, ...]}]``,
per document the raw responses (loglikelihood pairs, or generated strings). Run with the hub switched off
(``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``): the tasks read local JSON only.
"""
from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    task_dir, out_path, pairs = argv[0], argv[1], argv[2:]
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=task_dir)
    results = []
    for model, model_args in zip(pairs[::2], pairs[1::2]):
        run = simple_evaluate(model=model, model_args=model_args, tasks=["kvpage_mc", "kvpage_gen"],
                              task_manager=manager, log_samples=True, batch_size=1)
        results.append({task: sorted(({"doc_id": s["doc_id"], "resps": s["resps"]} for s in samples),
                                       key=lambda s: s["doc_id"])
                         for task, samples in run["samples"].items()})
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
