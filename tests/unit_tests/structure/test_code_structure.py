"""Structural rules of the package, checked on its source: no flags inside core, no import circles, no
hidden module-level channels read by the forward step, no settings poked into built model modules."""
from __future__ import annotations

import ast
import importlib
import os
import re
import sys
import types

import pytest
import torch
from testlib import ROOT

PACKAGE = os.path.join(ROOT, "megatron_cai")


def _sources(top: str) -> dict[str, str]:
    """{dotted module name: path} of every .py file under ``top`` (a package directory)."""
    out = {}
    base = os.path.dirname(top)
    for dirpath, _, files in os.walk(top):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


MODULES = _sources(PACKAGE)


# ---------------------------------------------------------------------------------------- flags
def test_core_never_sees_a_namespace_and_nothing_reads_flags_by_getattr():
    core = {m: p for m, p in MODULES.items() if m.startswith("megatron_cai.core")}
    assert len(core) > 40
    offenders = []
    for path in core.values():
        text = open(path).read()
        for pattern in (r"\bargs\.", r"\bargparse\b", r"Namespace"):
            for m in re.finditer(pattern, text):
                line = text.count("\n", 0, m.start()) + 1
                offenders.append(f"{os.path.relpath(path, ROOT)}:{line}: {pattern}")
    assert not offenders, "core code must take typed configs, not flags:\n" + "\n".join(offenders)
    getattr_args = [f"{os.path.relpath(p, ROOT)}:{open(p).read()[:m.start()].count(chr(10)) + 1}"
                    for p in MODULES.values() for m in re.finditer(r"getattr\(\s*args\b", open(p).read())]
    assert not getattr_args, "read flags through the typed config, not getattr(args, ...):\n" + "\n".join(getattr_args)


def test_the_grep_rules_catch_an_offender(tmp_path):
    """The patterns above do match the constructs they forbid (a check of the check)."""
    text = "def f(args):\n    return getattr(args, 'x', 1) + args.y\n"
    assert re.search(r"\bargs\.", text) and re.search(r"getattr\(\s*args\b", text)


# ------------------------------------------------------------------------------------ contracts
# Model chunks, gradient reducers and optimizers have written contracts (core.distributed.contracts,
# core.optimizer.clip_grads.GlobalNormClipping): nothing asks one what it is. Forbidden: getattr/hasattr for
# a contract member (getattr(m, "module", m), getattr(m, "reducer", None), hasattr(r, "timers"),
# getattr(optimizer, "state_dict_copies", False), ...), and hasattr on a model chunk (hasattr(model, ...)).
_CONTRACT_MEMBERS = ("module", "reducer", "set_is_last_microbatch", "zero_grad_buffer", "finish_grad_sync",
                     "grad_comm_bytes", "data_parallel_kind", "carries_feedback", "holds_squinch_state", "timers",
                     "comms", "step_skipped", "rescale_feedback", "inter_node_bytes_sent", "bytes_sent",
                     "chunks", "state_dict_copies", "grad_scaler", "moment_tensors")
_PROBES = (
    r"\b(?:getattr|hasattr)\(\s*[^,()]+,\s*[\"'](?:" + "|".join(_CONTRACT_MEMBERS) + r")[\"']",
    r"\bhasattr\(\s*(?:\w+\.)*(?:model\w*|chunk\w*|ddp|m)\s*,",
)


def _probes(text: str) -> list[int]:
    """Line numbers of contract probes in ``text``."""
    return sorted({text.count("\n", 0, m.start()) + 1 for p in _PROBES for m in re.finditer(p, text)})


def test_nothing_probes_model_chunks_or_reducers_for_their_members():
    offenders = [f"{os.path.relpath(path, ROOT)}:{line}: {open(path).read().splitlines()[line - 1].strip()}"
                 for path in MODULES.values() for line in _probes(open(path).read())]
    assert not offenders, "use the contracts in core/distributed/contracts.py, not probing:\n" + "\n".join(offenders)


def test_the_probe_rule_catches_each_offender_and_spares_parameter_attributes():
    offenders = ['getattr(m, "module", m)', "getattr( chunk ,'reducer', None)", 'hasattr(r, "timers")',
                 'hasattr(model, "set_is_last_microbatch")', "hasattr(self.model_chunk, 'anything')",
                 'hasattr(m, "buffer")', 'getattr(c, "holds_squinch_state", False)',
                 'getattr(optimizer, "chunks", [])', 'getattr(self.optimizer, "state_dict_copies", False)',
                 'getattr(self.optimizer, "grad_scaler", None)']
    for text in offenders:
        assert _probes(text) == [1], text
    spared = ['getattr(p, "shared_embedding", False)', 'getattr(p, "tp_dim", None)', 'hasattr(tokens, "numpy")',
              'getattr(work, "work", work)', 'getattr(m, "modules_to_save", None)', "m.module.named_parameters()"]
    for text in spared:
        assert _probes(text) == [], text
    assert _probes("x = 1\ny = getattr(m, 'module', m)\n") == [2]


# -------------------------------------------------------------------------------------- imports
def _imports(name: str, path: str) -> set[str]:
    """Package modules that ``name`` imports anywhere in its source (module level or inside functions)."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                base = parts if is_pkg else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # ``from pkg import sub`` imports the submodule when there is one, else the package itself
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # ``import a.b.c`` of a package path: the deepest known module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_two_modules_import_each_other_directly_or_through_others():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert graph["megatron_cai.core.distributed.reducers"] >= {"megatron_cai.core.distributed.squinch_reducer"}
    cycles = _cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _core_folder(module: str) -> str | None:
    """The folder of ``core/`` (or its top-level module) that holds ``module``; None outside core."""
    prefix = "megatron_cai.core."
    return prefix + module[len(prefix):].split(".")[0] if module.startswith(prefix) else None


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """{folder: {folder it imports: [the module-level imports that make the edge]}} inside core."""
    out: dict[str, dict[str, list[str]]] = {}
    for name, targets in graph.items():
        src = _core_folder(name)
        for t in targets:
            dst = _core_folder(t)
            if src is not None and dst is not None and dst != src:
                out.setdefault(src, {}).setdefault(dst, []).append(f"{name} -> {t}")
    return out


def _folder_cycles(graph: dict[str, set[str]]) -> list[str]:
    folders = _folder_graph(graph)
    report = []
    for cycle in _cycles({f: set(edges) for f, edges in folders.items()}):
        members = set(cycle)
        edges = sorted(e for f in cycle for g, es in folders.get(f, {}).items() if g in members for e in es)
        report.append(" <-> ".join(cycle) + ":\n    " + "\n    ".join(edges))
    return report


def test_no_two_folders_of_core_import_each_other():
    """Each folder of core/ is a layer: none imports (through any of its modules) a folder that imports it
    back, e.g. optimizer -> distributed -> optimizer."""
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    folders = _folder_graph(graph)
    assert "megatron_cai.core.distributed" in folders["megatron_cai.core.optimizer"]  # the graph sees real edges
    cycles = _folder_cycles(graph)
    assert not cycles, "folder-level import circles in core/:\n" + "\n".join(cycles)


def test_the_folder_check_finds_a_planted_circle_no_module_cycle_shows():
    core = "megatron_cai.core."
    graph = {core + "a.x": {core + "b.y"}, core + "b.y": set(), core + "b.z": {core + "a.w", core + "device"},
             core + "a.w": set(), core + "device": set(), "megatron_cai.training.t": {core + "a.x"}}
    assert _cycles(graph) == []  # no module imports itself back ...
    assert _folder_cycles(graph) == [f"{core}a <-> {core}b:\n    {core}a.x -> {core}b.y\n    {core}b.z -> {core}a.w"]
    del graph[core + "b.z"]
    assert _folder_cycles(graph) == []


# --------------------------------------------------------------------------- the checkpoint package
CHECKPOINT = "megatron_cai.training.checkpoint"
CHECKPOINT_TESTS = ("tests/unit_tests/checkpoint/", "tests/functional_tests/checkpoint/")  # may test its modules


def _scripts() -> dict[str, str]:
    """{path relative to the repository: path} of the Python code outside the package: entry point, tools,
    benchmarks and tests."""
    out = {"pretrain_gpt.py": os.path.join(ROOT, "pretrain_gpt.py")}
    for top in ("tools", "bench", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            out.update({os.path.relpath(os.path.join(dirpath, f), ROOT): os.path.join(dirpath, f)
                        for f in files if f.endswith(".py")})
    return out


def _private_checkpoint_imports(importer: str, path: str) -> list[str]:
    """The checkpoint package's modules (not its ``__init__``) that ``importer``, outside it, imports."""
    if importer == CHECKPOINT or importer.startswith(CHECKPOINT + "."):
        return []
    return sorted(t for t in _imports(importer, path) if t.startswith(CHECKPOINT + "."))


def test_code_outside_the_checkpoint_package_imports_only_its_public_names():
    assert {f"{CHECKPOINT}.torch_format", f"{CHECKPOINT}.dist_format", f"{CHECKPOINT}.async_save"} <= set(MODULES)
    importers = {**MODULES, **{rel: p for rel, p in _scripts().items() if not rel.startswith(CHECKPOINT_TESTS)}}
    offenders = [f"{name} imports {t}" for name, path in importers.items()
                 for t in _private_checkpoint_imports(name, path)]
    assert not offenders, (f"import from {CHECKPOINT} (its __init__), not from its modules:\n" + "\n".join(offenders))


def test_the_checkpoint_import_rule_catches_a_private_import(tmp_path):
    path = tmp_path / "offender.py"
    path.write_text(f"import {CHECKPOINT}.file_io\nfrom {CHECKPOINT} import Checkpointer, torch_format\n"
                    f"from {CHECKPOINT}.run_dirs import TRACKER\nfrom {CHECKPOINT} import save_torch\n")
    assert _private_checkpoint_imports("tools/offender.py", str(path)) == [
        f"{CHECKPOINT}.file_io", f"{CHECKPOINT}.run_dirs", f"{CHECKPOINT}.torch_format"]
    assert _private_checkpoint_imports(f"{CHECKPOINT}.checkpointer", str(path)) == []  # inside: free
    assert _private_checkpoint_imports(CHECKPOINT, str(path)) == []


# ------------------------------------------------------------------------------ hidden channels
def _global_names(fn: types.FunctionType) -> set[str]:
    names = set(fn.__code__.co_names)
    for const in fn.__code__.co_consts:
        if isinstance(const, types.CodeType):
            names |= set(const.co_names)
    return names


_IMMUTABLE = (int, float, str, bytes, bool, type(None), frozenset, tuple)


def _mutable_globals(fn: types.FunctionType, seen: set | None = None) -> list[str]:
    """Module-level values that ``fn`` (and the same module's functions it calls) reads and that could
    carry state between calls: anything but modules, classes, functions and immutable constants."""
    seen = set() if seen is None else seen
    if fn in seen:
        return []
    seen.add(fn)
    bad = []
    for name in _global_names(fn):
        if name not in fn.__globals__:
            continue  # a builtin or an attribute name
        value = fn.__globals__[name]
        if isinstance(value, types.FunctionType) and value.__module__ == fn.__module__:
            bad += _mutable_globals(value, seen)
        elif isinstance(value, types.ModuleType | type | types.FunctionType | types.BuiltinFunctionType):
            continue
        elif isinstance(value, _IMMUTABLE):
            continue
        else:
            bad.append(f"{fn.__module__}.{name} ({type(value).__name__})")
    return bad


def test_forward_step_reads_no_module_level_mutable_state():
    import pretrain_gpt
    from megatron_cai.training.features import distill

    assert _mutable_globals(pretrain_gpt.forward_step) == []
    # The distiller arrives as an argument (bound by the Trainer), never through a module global.
    assert "distiller" in pretrain_gpt.forward_step.__code__.co_varnames
    stateful = [n for n, v in vars(distill).items() if not n.startswith("__") and n != "annotations"
                and not isinstance(v, (types.ModuleType, type, types.FunctionType, *_IMMUTABLE))]
    assert stateful == []


def test_the_mutable_global_check_catches_a_module_global():
    namespace: dict = {"__name__": "fake_mod"}
    exec("_ACTIVE = {}\ndef get():\n    return _ACTIVE\ndef forward_step(it, model):\n    return get()\n", namespace)
    assert _mutable_globals(namespace["forward_step"]) == ["fake_mod._ACTIVE (dict)"]


class _SetattrRecorder:
    """Records ``module.attr = value`` on nn.Modules made from code that is neither a method of that
    module's class (constructor, hooks, its own forward) nor running inside some module's __init__."""

    def __init__(self) -> None:
        self.records: list[str] = []
        self._orig = torch.nn.Module.__setattr__

    def __enter__(self):
        recorder, orig = self, self._orig

        def setattr_(module, name, value):
            recorder._check(module, name)
            orig(module, name, value)

        torch.nn.Module.__setattr__ = setattr_
        return self

    def __exit__(self, *exc):
        torch.nn.Module.__setattr__ = self._orig

    def _check(self, module, name) -> None:
        frame = sys._getframe(2)
        own_codes = {getattr(getattr(v, "__func__", v), "__code__", None)
                     for cls in type(module).__mro__ for v in vars(cls).values()}
        caller = frame.f_code
        if caller in own_codes:
            return
        f = frame
        while f is not None:  # inside any module's constructor (e.g. GPTModel attaching quantizers)
            if f.f_code.co_name == "__init__" and isinstance(f.f_locals.get("self"), torch.nn.Module):
                return
            f = f.f_back
        self.records.append(f"{type(module).__name__}.{name} set by {caller.co_name} "
                            f"({os.path.relpath(caller.co_filename, ROOT)}:{frame.f_lineno})")


def test_nothing_sets_attributes_on_model_modules_from_outside_their_constructors():
    import pretrain_gpt
    from megatron_cai.training.training import Trainer

    argv = ["--squared-relu",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--vocab-size", "64", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--eval-interval", "1", "--eval-iters", "1", "--log-interval", "1",
            "--attention-zreg-coeff", "0.1", "--recompute-granularity", "full", "--qat", "int8", "--qat-clamp",
            "static", "--no-exit-signal-handler"]
    config, tokenizer = pretrain_gpt.build_run(argv, world_size=1)
    with _SetattrRecorder() as rec:
        trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step,
                          tokenizer)
        state = trainer.train()
    assert state.iteration == 2
    assert trainer.lse_stats.per_layer(), "the explicit lse collector recorded nothing"
    assert rec.records == []


def test_the_setattr_recorder_catches_a_poke_from_outside():
    from megatron_cai.core import parallel_state as ps
    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.core.transformer.block import TransformerBlock

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    block = TransformerBlock(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=8), [0], True)
    with _SetattrRecorder() as rec:
        block.recompute = True  # what the training loop used to do
        block.train()  # nn.Module's own methods are fine
    assert len(rec.records) == 1 and rec.records[0].startswith("TransformerBlock.recompute set by")


def _resolves(name: str) -> bool:
    """A path in the repository (``core/...`` is under megatron_cai/), or an importable dotted name:
    the longest importable module prefix, then attributes (``core.x.Class.method``)."""
    path = "megatron_cai/" + name if name.startswith(("core", "training")) else name
    if os.path.exists(os.path.join(ROOT, path)):
        return True
    if "/" in name:
        return False
    dotted = "megatron_cai." + name if name.startswith(("core", "training")) else name
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", ["docs/design.md", "docs/squinch-format.md"])
def test_backticked_code_names_in_the_design_docs_resolve(doc):
    text = open(os.path.join(ROOT, doc)).read()
    names = set(re.findall(r"`((?:megatron_cai|core|training|tools|tests|bench|docs|pretrain_gpt)[\w./-]*)`", text))
    assert len(names) >= 10, names
    missing = sorted(n for n in names if not _resolves(n))
    assert not missing, f"{doc} names things the code does not have: {missing}"


def test_the_name_resolver_rejects_names_that_do_not_exist():
    assert _resolves("core.distributed.ddp.DistributedDataParallel.finish_grad_sync")
    assert _resolves("core/squinch/format.py") and _resolves("core.squinch.format.S")
    assert not _resolves("core.distributed.ddp.DistributedDataParallel.no_such_method")
    assert not _resolves("core.squinch.no_such_module") and not _resolves("core/nowhere.py")


def test_nothing_in_the_repository_points_at_the_team_notes():
    hits = []
    for top in ("README.md", "docs", "megatron_cai", "tools", "pretrain_gpt.py", "bench", "tests", "setup.py"):
        path = os.path.join(ROOT, top)
        files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                                                    if f.endswith((".py", ".md", ".txt", ".json", ".sh"))]
        for f in files:
            if f == os.path.abspath(__file__):
                continue
            text = open(f, errors="replace").read()
            if "shared/" in text:
                hits.append(os.path.relpath(f, ROOT))
    assert not hits, hits


# ------------------------------------------------------------------------------- the design map
_MAP_ENTRY = re.compile(r"[\w.-]+(?:/[\w.-]+)*(?:\.py|/)")


def _design_map(text: str) -> set[str]:
    """Paths of the modules listed in the first code block of ``## Layers``: an indented tree, one entry per
    line (``name.py`` or ``folder/``, then a description); deeper lines that start otherwise continue one."""
    block = text[text.index("## Layers"):].split("```")[1]
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    out = set()
    for line in block.splitlines():
        head = line.strip().split("  ")[0]
        if not head or not _MAP_ENTRY.fullmatch(head):
            continue
        indent = len(line) - len(line.lstrip(" "))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (stack[-1][1] if stack else "") + head
        if head.endswith("/"):
            stack.append((indent, path))
        else:
            out.add(path)
    return out


def test_the_design_map_lists_every_module():
    mapped = {p for p in _design_map(open(os.path.join(ROOT, "docs", "design.md")).read())
              if p.startswith("megatron_cai/")}
    modules = {os.path.relpath(p, ROOT) for p in MODULES.values() if not p.endswith("__init__.py")}
    assert len(modules) > 80
    assert not modules - mapped, f"docs/design.md's map (## Layers) lacks {sorted(modules - mapped)}"
    assert not mapped - modules, f"docs/design.md's map lists modules that do not exist: {sorted(mapped - modules)}"


def test_the_design_map_reader_sees_a_missing_module():
    text = ("## Layers\n```\nmegatron_cai/\n  core/             the library\n    device.py       devices\n"
            "    models/gpt/\n      model.py      GPTModel: embedding -> layers\n                    (continued)\n"
            "  training/\n    training.py     the loop\ntools/            scripts\n```\n")
    assert _design_map(text) == {"megatron_cai/core/device.py", "megatron_cai/core/models/gpt/model.py",
                                 "megatron_cai/training/training.py"}


def test_training_has_at_most_14_top_level_modules():
    """Issue 32's bound: each top-level module of training/ says what it holds (a package counts once)."""
    top = os.path.join(PACKAGE, "training")
    entries = sorted(n for n in os.listdir(top) if n != "__init__.py" and not n.startswith((".", "__"))
                     and (n.endswith(".py") or os.path.isfile(os.path.join(top, n, "__init__.py"))))
    assert "checkpoint" in entries and len(entries) <= 14, entries


def _test_folders_without_init(tests_root: str) -> list[str]:
    """Folders of unit_tests/ and functional_tests/ holding test modules but no ``__init__.py``."""
    out = []
    for top in ("unit_tests", "functional_tests"):
        for dirpath, _, files in os.walk(os.path.join(tests_root, top)):
            if any(f.endswith(".py") for f in files) and "__init__.py" not in files:
                out.append(os.path.relpath(dirpath, tests_root))
    return sorted(out)


def test_every_test_folder_is_a_package(tmp_path):
    """Test modules are imported by their dotted path (tests/unit_tests/<area>/...), so that two areas may hold
    files of the same name; shared helpers live in tests/testlib/."""
    assert _test_folders_without_init(os.path.join(ROOT, "tests")) == []
    (tmp_path / "unit_tests" / "newarea").mkdir(parents=True)
    (tmp_path / "unit_tests" / "newarea" / "test_x.py").write_text("")
    assert _test_folders_without_init(str(tmp_path)) == ["unit_tests/newarea"]


# ------------------------------------------------------------------------------- group timeouts
# Calls that make a process group without the run's timeout, each with its reason: the helper itself (it sets
# the timeout), the one-process group FSDP2 needs at world size 1 (no peer to wait for), the test harness.
_UNTIMED_GROUP_CALLS = {
    ("megatron_cai.core.parallel_state", "new_group"),
    ("megatron_cai.core.distributed.fsdp", "build_dp_mesh"),
    ("megatron_cai.testing.distributed", "_entry"),
}


def _untimed_group_calls(modules: dict[str, str]) -> list[tuple[str, str, int]]:
    """(module, enclosing function, line) of every ``dist.new_group`` / ``init_process_group`` /
    ``new_subgroups`` call without ``timeout=`` (calls to parallel_state's own ``new_group`` helper are fine)."""
    out = []
    for module, path in modules.items():
        tree = ast.parse(open(path).read())
        enclosing = {}
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    enclosing[node] = fn.name  # inner functions come later in the walk and win
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call) or not isinstance(call.func, (ast.Attribute, ast.Name)):
                continue
            name = call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id
            owner = call.func.value.id if isinstance(call.func, ast.Attribute) and isinstance(
                call.func.value, ast.Name) else None
            if name not in ("new_group", "init_process_group", "new_subgroups", "new_subgroups_by_enumeration"):
                continue
            if name == "new_group" and owner in ("ps", "parallel_state", None):
                continue  # the package's helper, which applies --distributed-timeout-minutes
            if not any(k.arg == "timeout" for k in call.keywords):
                out.append((module, enclosing.get(call, "<module>"), call.lineno))
    return sorted(set(out))


def test_every_process_group_is_made_with_the_runs_timeout():
    offenders = [o for o in _untimed_group_calls(MODULES) if o[:2] not in _UNTIMED_GROUP_CALLS]
    assert not offenders, f"process groups made without timeout= (use parallel_state.new_group): {offenders}"


def test_the_group_timeout_rule_catches_an_untimed_group(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import torch.distributed as dist\ndef f():\n    return dist.new_group([0, 1])\n"
                 "def g():\n    dist.init_process_group('gloo', timeout=t)\n")
    assert _untimed_group_calls({"m": str(p)}) == [("m", "f", 3)]


def test_parallel_state_gives_every_group_the_timeout(monkeypatch):
    import datetime

    import torch.distributed as dist

    from megatron_cai.core import parallel_state as ps

    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, **kw: made.append(kw) or "group")
    try:
        ps.initialize_model_parallel(1, 1, timeout=datetime.timedelta(minutes=3))
        assert ps.new_group([0], backend="gloo") == "group"
    finally:
        ps.destroy_model_parallel()
    assert made == [{"backend": "gloo", "timeout": datetime.timedelta(minutes=3)}]


def _tests_outside_topic_folders(tests_root: str) -> list[str]:
    """Test modules lying directly in unit_tests/ or functional_tests/ instead of a topic folder."""
    return sorted(os.path.join(top, f) for top in ("unit_tests", "functional_tests")
                  for f in os.listdir(os.path.join(tests_root, top)) if f.startswith("test") and f.endswith(".py"))


def test_every_test_lives_in_a_topic_folder(tmp_path):
    assert _tests_outside_topic_folders(os.path.join(ROOT, "tests")) == []
    for top in ("unit_tests", "functional_tests", "unit_tests/squinch"):
        (tmp_path / top).mkdir(parents=True, exist_ok=True)
    (tmp_path / "unit_tests" / "squinch" / "test_codec.py").write_text("")
    assert _tests_outside_topic_folders(str(tmp_path)) == []
    (tmp_path / "functional_tests" / "test_stray.py").write_text("")
    assert _tests_outside_topic_folders(str(tmp_path)) == ["functional_tests/test_stray.py"]
