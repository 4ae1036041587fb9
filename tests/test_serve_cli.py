"""``kvpage serve``'s command line: vLLM's flags word for word, clean usage errors, help,
start-up warnings and the stats line. Nothing here loads a model except the two
subprocess tests of start-up errors."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import pytest

from kvpage.entrypoints.cli.main import build_parser, main
from kvpage.entrypoints.cli.args import UsageError, normalize_bool_flags
from kvpage.core.config import EngineConfig
from kvpage.entrypoints.cli.serve import config_from_args, model_of
from kvpage.entrypoints.cli.serve_startup import device_warnings
from kvpage.entrypoints.openai.stats_log import is_idle, stats_line

SEED = ("--port 8000 --gpu-memory-utilization 0.95 --block-size 16 --max-num-seqs 256 --enable-chunked-prefill True "
        "--max-num-batched-tokens 2048 --enable-prefix-caching").split()
FLAGS = {"--x", "--y"}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, expected", [
    (["--x"], ["--x"]),
    (["--x", "True"], ["--x"]),
    (["--x", "false"], ["--no-x"]),
    (["--x=0"], ["--no-x"]),
    (["--x=TRUE", "--y", "1"], ["--x", "--y"]),
    (["--x", "model"], ["--x", "model"]),  # not a boolean word: a positional stays where it is
    (["--no-x"], ["--no-x"]),
    (["--x", "--", "--y=bad"], ["--x", "--", "--y=bad"]),
])
def test_boolean_flags_take_an_optional_value(argv, expected):
    assert normalize_bool_flags(argv, FLAGS) == expected


@pytest.mark.parametrize("argv, message", [(["--x=maybe"], "expected a boolean"), (["--no-x=true"], "takes no value")])
def test_bad_boolean_values_are_usage_errors(argv, message):
    with pytest.raises(UsageError, match=message):
        normalize_bool_flags(argv, FLAGS)


def test_the_seed_command_line_parses_word_for_word():
    args = parse(*SEED, "--model", "/m")
    config = config_from_args(args)
    assert (args.port, model_of(args)) == (8000, "/m")
    assert (config.gpu_memory_utilization, config.block_size, config.max_num_seqs, config.max_num_batched_tokens) == \
        (0.95, 16, 256, 2048)
    assert config.enable_chunked_prefill and config.enable_prefix_caching


@pytest.mark.parametrize("argv, chunked, prefix", [
    (["--enable-chunked-prefill", "False"], False, True),
    (["--enable-chunked-prefill=false", "--enable-prefix-caching=0"], False, False),
    (["--no-enable-prefix-caching"], True, False),
    (["--enable-prefix-caching", "/model/path"], True, True),
])
def test_boolean_forms(argv, chunked, prefix):
    args = parse(*argv)
    assert (args.enable_chunked_prefill, args.enable_prefix_caching) == (chunked, prefix)


def test_model_positional_or_flag():
    assert model_of(parse("/a")) == "/a" and model_of(parse("--model", "/a")) == "/a"
    assert model_of(parse("/a", "--model", "/a")) == "/a"
    assert model_of(parse()) == "smollm2-135m"


def test_enforce_eager_and_num_threads_reach_the_config():
    config = config_from_args(parse("--enforce-eager", "false", "--num-threads", "3"))
    assert (config.enforce_eager, config.num_threads) == (False, 3)
    assert config_from_args(parse()).enforce_eager is None  # the engine's default for the device


def test_exact_flag_reaches_the_config_and_a_contradiction_is_a_usage_error():
    config = config_from_args(parse("--exact"))
    assert (config.exact, config.enforce_eager, config.onednn_linears) == (True, None, None)
    with pytest.raises(UsageError, match="exact=True runs the model eagerly"):
        config_from_args(parse("--exact", "--onednn-linears"))


def test_batch_invariant_flag_reaches_the_config():
    assert not config_from_args(parse()).batch_invariant
    config = config_from_args(parse("--batch-invariant"))
    assert config.batch_invariant and config.exact_mode
    with pytest.raises(UsageError, match="batch_invariant=True runs the model eagerly"):
        config_from_args(parse("--batch-invariant", "--no-enforce-eager"))


def test_linear_compute_dtype_flag_reaches_the_config():
    assert config_from_args(parse()).linear_compute_dtype == "auto"
    assert config_from_args(parse("--linear-compute-dtype", "float32")).linear_compute_dtype == "float32"
    with pytest.raises(UsageError, match="contradicts onednn_linears=False"):
        config_from_args(parse("--linear-compute-dtype", "float32", "--no-onednn-linears"))
    with pytest.raises(SystemExit):  # argparse's one-line usage error
        parse("--linear-compute-dtype", "half")


def test_kv_tier_and_event_flags_reach_the_config():
    config = config_from_args(parse("--kv-offloading-size", "0.5", "--kv-disk-cache", "/tmp/kv",
                                    "--kv-disk-cache-size", "2", "--kv-events-config",
                                    '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", '
                                    '"topic": "kv"}'))
    assert (config.kv_offloading_size, config.kv_disk_cache, config.kv_disk_cache_size) == (0.5, "/tmp/kv", 2.0)
    events = config.kv_events_config
    assert (events.enable_kv_cache_events, events.publisher, events.endpoint, events.topic) == (
        True, "zmq", "tcp://127.0.0.1:5557", "kv")
    plain = config_from_args(parse())
    assert (plain.kv_offloading_size, plain.kv_disk_cache, plain.kv_events_config) == (None, None, None)


@pytest.mark.parametrize("argv, message", [
    (["--kv-offloading-size", "-1"], "--kv-offloading-size"),
    (["--kv-offloading-size", "lots"], "expected a number"),
    (["--kv-disk-cache-size", "2"], "kv_disk_cache_size needs kv_disk_cache"),
    (["--kv-events-config", "{oops"], "not valid JSON"),
    (["--kv-events-config", '{"colour": 1}'], "unknown key"),
    (["--kv-offloading-size", "1", "--no-enable-prefix-caching"], "need enable_prefix_caching"),
    (["/a", "--model", "/b"], "two models given"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--enable-chunked-prefill=maybe"], "expected a boolean"),
    (["--dtype", "float8"], "invalid choice: 'float8'"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--block-size", "3"], "block_size must be a power of two"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in"),
    (["--num-threads", "0"], "num_threads must be a positive integer"),
    (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),  # before the model loads
    (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be a positive integer"),
    (["--max-waiting", "-1"], "--max-waiting: must be >= 1"),
    (["--max-tokens-cap", "-5"], "--max-tokens-cap: must be >= 1"),
    (["--max-body-bytes", "0"], "not a size of at least one byte"),
    (["--port", "70000"], "a port is in 0-65535"),
    (["--max-request-seconds", "-1"], "--max-request-seconds"),
    (["--stats-interval-s", "-1"], "--stats-interval-s"),
    (["--log-level", "loud"], "invalid choice: 'loud'"),
    (["--gpu-mem", "0.5"], "unrecognized arguments"),  # no abbreviations
])
def test_usage_errors_exit_2_with_serves_usage(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("usage: kvpage serve") and message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [(["--num-prompts", "0"], "--num-prompts: must be >= 1"),
                                           (["--max-tokens", "-3"], "--max-tokens: must be >= 1")])
def test_demo_usage_errors_exit_2_before_loading(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_demo_of_an_unknown_model_is_one_line_and_exit_1(capsys):
    assert main(["demo", "--model", "/no/such/model", "--no-compare"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvpage demo: ") and "Traceback" not in err and err.count("\n") == 1


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == "kvpage 0.2.0"


def test_every_serve_flag_has_help_defaults_and_choices(capsys):
    serve = build_parser().parse_args(["serve"]).subparser
    missing = [a.dest for a in serve._actions if not a.help]
    assert not missing, missing
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for needle in ("(default: 16)", "(default: 0.9)", "(default: True)", "(default: 10.0)",
                   "{auto,float32,bfloat16,float16,fp32,bf16,fp16,half}", "{auto,cpu,cuda,cuda:N}",
                   "{debug,info,warning,error,critical}", "--enable-chunked-prefill, --no-enable-chunked-prefill"):
        assert needle in out, needle


# ---------------------------------------------------------------------- start-up warnings
def test_gpu_memory_utilization_on_cpu_is_named_in_a_warning():
    config = EngineConfig(gpu_memory_utilization=0.95)
    (warning,) = device_warnings({"gpu_memory_utilization"}, "cpu", config)
    assert "--gpu-memory-utilization does not apply on cpu" in warning and "CPU default" in warning
    assert device_warnings(set(), "cpu", config) == []
    assert device_warnings({"gpu_memory_utilization"}, "cuda", config) == []
    (ignored,) = device_warnings({"gpu_memory_utilization"}, "cuda", EngineConfig(kv_cache_memory=1 << 30))
    assert "ignored" in ignored and "byte budget" in ignored


def test_explicit_flags_are_told_from_defaults():
    parser = build_parser()
    serve = parser.parse_args(["serve"]).subparser
    assert serve.explicit_dests(["serve", "--gpu-memory-utilization=0.9", "--block-size", "4"]) == \
        {"gpu_memory_utilization", "block_size"}


# ---------------------------------------------------------------------- the stats line
def test_stats_line_from_deltas():
    before = {"prompt_tokens": 100, "generation_tokens": 10, "prefix_cache_queries": 50, "prefix_cache_hits": 5,
              "num_preemptions": 1}
    after = {"prompt_tokens": 300, "generation_tokens": 60, "prefix_cache_queries": 150, "prefix_cache_hits": 80,
             "num_preemptions": 3, "num_running": 4, "num_waiting": 2, "kv_cache_usage": 0.25,
             "kv_fragmentation": 0.125}
    line = stats_line(before, after, 10.0)
    assert line == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 4 reqs, "
                    "Waiting: 2 reqs, KV cache usage: 25.0%, KV fragmentation: 12.5%, Prefix cache hit rate: 75.0%, "
                    "Preemptions: 2 (total 3)")
    assert not is_idle(before, after) and is_idle(before, dict(before))


# ---------------------------------------------------------------------- start-up failures (subprocesses)
def _serve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpage", "serve", *argv], capture_output=True, text=True,
                          timeout=180, cwd=os.path.dirname(__file__))


def test_a_bad_model_path_is_one_line_and_exit_1(tmp_path):
    missing = str(tmp_path / "no-such-model")
    result = _serve(missing, "--port", "0")
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvpage serve: error:")]
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert len(errors) == 1 and "unknown model" in errors[0] and missing in errors[0]
    debug = _serve(missing, "--port", "0", "--log-level", "debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "unknown model" in debug.stderr


def test_a_busy_port_is_one_line_and_exit_1():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        result = _serve("--port", str(busy.getsockname()[1]), "--host", "127.0.0.1")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("kvpage serve: error: cannot listen on 127.0.0.1:")
