"""Rewrites of the compiled forward's dynamo graph, before inductor sees it.

Two passes, each a measured fix for code inductor generates from HF modules on CPU:
``fuse_sibling_linears`` (below) and ``realize_rotary_tables``.

**Sibling linears as one matmul: q/k/v, and gate/up.**

HF modules call ``q_proj``, ``k_proj`` and ``v_proj`` (and an MLP's ``gate_proj`` and
``up_proj``) one after another on the same input. vLLM's model code merges them into one
weight (``QKVParallelLinear``, ``MergedColumnParallelLinear``); kvpage cannot change the
model's code, so it merges them in the traced graph instead: ``fuse_sibling_linears``
rewrites every set of ``kvpage::onednn_linear`` calls on one input into a single
``kvpage::onednn_linear_fused`` call whose output columns are the members' outputs side by
side, each member's use reading its column range. Linears that compute wider than the
model each cast their input; repeated casts of one node to one dtype are merged first, so
that such siblings share one input.

Why: one matmul over the members' weights side by side is faster than the members one
after another (fewer, larger oneDNN calls; docs/performance.md has the measurements), and
each custom-op call saved is tens of microseconds of dispatch.

The fused weight is packed on first use (``onednn_linear.fused_weight``) and lives as long
as the members' oneDNN copies, which stay for the eager path: the fused weights' memory
comes on top. The rewrite is numerically the same matmul per output column, but oneDNN
may block a wider matmul differently, so, like the oneDNN linears themselves, it is not
bit-exact against separate calls.
"""
from __future__ import annotations

import os
from collections import defaultdict

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .onednn_linear import onednn_linear  # registers kvpage::onednn_linear_fused too

_LINEAR_TARGETS = (onednn_linear, torch.ops.kvpage.onednn_linear, torch.ops.kvpage.onednn_linear.default)


def _linear_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _LINEAR_TARGETS and len(node.args) == 3 and not node.kwargs


def _out_features(weight: torch.fx.Node) -> int:
    value = weight.meta.get("example_value")
    return int(value.shape[0]) if value is not None else -1


def _record_example_value(node: torch.fx.Node) -> None:
    """Give a node a pass inserted the fake ``example_value`` dynamo gives its own nodes,
    computed from its inputs' (in their fake mode). AOTAutograd's disk cache refuses a graph
    with a method call on a tensor node that lacks one, and without that cache every start
    traces the whole model again (about 15 s of SmolLM2's start-up here)."""
    values = []

    def example(arg):
        if isinstance(arg, torch.fx.Node):
            value = arg.meta.get("example_value")
            if value is None:
                raise LookupError(arg.name)
            values.append(value)
            return value
        return arg

    try:
        args = torch.fx.node.map_aggregate(node.args, example)
    except LookupError:
        return  # an input without one: leave it (the cache then bypasses, as before)
    if not values or not all(isinstance(v, FakeTensor) for v in values):
        return
    fake_mode = values[0].fake_mode
    if any(v.fake_mode is not fake_mode for v in values):
        return
    with fake_mode:
        node.meta["example_value"] = node.target(*args)


def _merge_repeated_casts(gm: torch.fx.GraphModule) -> int:
    """Make every ``y.to(dtype)`` of one ``y`` and dtype the first such node, so that
    linears computing wider than the model (each casting its own input) share one input;
    returns how many casts it removed."""
    first: dict[tuple, torch.fx.Node] = {}
    merged = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_method" or node.target != "to" or node.kwargs or len(node.args) != 2:
            continue
        if not isinstance(node.args[1], torch.dtype):
            continue
        key = (node.args[0], node.args[1])
        if key in first:
            node.replace_all_uses_with(first[key])
            gm.graph.erase_node(node)
            merged += 1
        else:
            first[key] = node
    return merged


def fuse_sibling_linears(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm`` in place (a dynamo graph); returns how many fused calls it made.

    A group is every ``kvpage::onednn_linear`` call on one input node whose weights'
    shapes are known, with biases on all members or none (repeated casts of one node to
    one dtype count as one input). The fused call goes where the group's first member
    was; weight nodes defined later (``get_attr``) move up to it.
    """
    merged = _merge_repeated_casts(gm)
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if _linear_call(node) and isinstance(node.args[0], torch.fx.Node):
            groups[node.args[0]].append(node)
    fused_calls = 0
    for x, members in groups.items():
        widths = [_out_features(m.args[1]) for m in members]
        with_bias = [m.args[2] is not None for m in members]
        if len(members) < 2 or min(widths) <= 0 or any(with_bias) != all(with_bias):
            continue
        first = members[0]
        for m in members:
            for arg in m.args[1:]:
                if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                    first.prepend(arg)  # no inputs, so safe to define earlier
        weights = [m.args[1] for m in members]
        biases = [m.args[2] for m in members] if all(with_bias) else []
        with gm.graph.inserting_before(first):
            fused = gm.graph.call_function(torch.ops.kvpage.onednn_linear_fused.default, (x, weights, biases))
            _record_example_value(fused)
            parts, start = [], 0
            for width in widths:
                parts.append(gm.graph.call_function(torch.narrow, (fused, -1, start, width)))
                _record_example_value(parts[-1])
                start += width
        for member, part in zip(members, parts):
            member.replace_all_uses_with(part)
            gm.graph.erase_node(member)
        fused_calls += 1
    if fused_calls or merged:
        gm.graph.lint()
        gm.recompile()
    return fused_calls


@torch.library.custom_op("kvpage::realized", mutates_args=())
def realized(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` that inductor must compute into a buffer (it cannot fuse through an
    opaque op), so its consumers load it instead of recomputing it."""
    return x.clone()


@realized.register_fake
def _(x):
    return torch.empty_like(x)


_TRIG = {"cos", "sin"}


def _trig_call(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _TRIG
    return node.op == "call_function" and node.target in (torch.cos, torch.sin)


def realize_rotary_tables(gm: torch.fx.GraphModule) -> int:
    """Put every ``cos``/``sin`` of the graph behind ``kvpage::realized``; returns how many.

    HF models compute the rotary tables once per forward and hand them to every layer;
    inductor inlines cheap pointwise values into each consumer, so each layer's rotary
    kernel evaluated cos and sin again for every query and key element: in SmolLM2's
    2048-token prefill, 1.6 ms per layer (30 layers), against one table of 2048 x 64
    computed once.
    """
    count = 0
    for node in list(gm.graph.nodes):
        if not _trig_call(node):
            continue
        with gm.graph.inserting_after(node):
            table = gm.graph.call_function(torch.ops.kvpage.realized.default, (node,))
            _record_example_value(table)
        node.replace_all_uses_with(table, delete_user_cb=lambda user: user is not table)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def cpp_wrapper_patches(example_inputs) -> dict:
    """Inductor settings for the graph's wrapper: on CPU, a C++ wrapper (``cpp_wrapper``).

    Inductor's default wrapper is Python code that calls each of the step's kernels and
    extern ops in turn (several hundred Python calls per step for a 30-layer model), all on
    the main thread while the other OpenMP threads wait; its C++ wrapper makes those calls
    from compiled code, which raises CPU throughput and shortens a warm start.
    ``KVPAGE_CPP_WRAPPER=0`` (or the user's own ``TORCHINDUCTOR_CPP_WRAPPER``) keeps
    inductor's choice. GPU graphs keep the Python wrapper.
    """
    if os.environ.get("KVPAGE_CPP_WRAPPER", "1") == "0" or "TORCHINDUCTOR_CPP_WRAPPER" in os.environ:
        return {}
    on_cpu = all(x.device.type == "cpu" for x in example_inputs if isinstance(x, torch.Tensor))
    return {"cpp_wrapper": True} if on_cpu else {}


def cpu_thread_patches(example_inputs) -> dict:
    """Inductor settings for the thread count of CPU kernels: read at run time
    (``cpp.dynamic_threads``) instead of baked in at compile time.

    Dynamo keeps one compiled entry per torch thread count, and a compiled engine with a
    thread governor compiles two at start-up (``thread_governor``). With the count baked
    in, inductor's cache keys differ too and the second entry compiles from scratch; read
    at run time, both entries' code is the same and the second loads from the cache.
    Measured (SmolLM2-135M bf16, Intel Xeon, empty cache): start-up 232 s -> 138 s, offline
    tok/s unchanged within noise (docs/performance.md). The user's own
    ``TORCHINDUCTOR_CPP_DYNAMIC_THREADS`` wins."""
    if "TORCHINDUCTOR_CPP_DYNAMIC_THREADS" in os.environ:
        return {}
    on_cpu = all(x.device.type == "cpu" for x in example_inputs if isinstance(x, torch.Tensor))
    return {"cpp.dynamic_threads": True} if on_cpu else {}


def kvpage_inductor(gm: torch.fx.GraphModule, example_inputs):
    """A ``torch.compile`` backend: this module's passes, then inductor."""
    from torch._inductor.compile_fx import compile_fx

    fuse_sibling_linears(gm)
    realize_rotary_tables(gm)
    patches = {**cpp_wrapper_patches(example_inputs), **cpu_thread_patches(example_inputs)}
    return compile_fx(gm, example_inputs, config_patches=patches)
