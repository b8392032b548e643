"""The layering: the core imports torch only; Megatron lives in the adapter."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_core_runs_with_megatron_blocked():
    """``import megatron`` made impossible: the functional API still imports and gives exact
    attention in a threaded world of 2 (compared with float64 full attention)."""
    code = textwrap.dedent("""
        import sys
        sys.modules["megatron"] = None  # any import of megatron.* now raises ImportError
        import torch, torch.distributed as dist
        import ulysses_mcore
        from ulysses_mcore import attention, call, exchange, kernels, options, validation, topology
        from ulysses_mcore.kernels import registry, ring, sdpa, tiled
        from tests.helpers import reference_attention, run_threaded
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(16, 2, 4, 8, generator=g) for _ in range(3))
        def fn(rank, world):
            qs, ks, vs = (t.chunk(world)[rank] for t in (q, k, v))
            return ulysses_mcore.ulysses_attention(qs, ks, vs, group=dist.group.WORLD, causal=True)
        out = torch.cat(run_threaded(2, fn))
        ref = reference_attention(q, k, v, causal=True)
        assert (out.double() - ref).abs().max() < 1e-5
        assert not any(m.startswith("megatron") and sys.modules[m] is not None for m in sys.modules)
        try:
            ulysses_mcore.UlyssesAttention
        except ImportError:
            print("adapter needs megatron: ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "adapter needs megatron: ok" in res.stdout


def _package_imports():
    """module -> the package modules it imports (at the top or inside functions), by ast."""
    import ast

    pkg = ROOT / "ulysses_mcore"
    mods = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in pkg.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                parts = base.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] if node.level else []) if node.level else ""
                target = target + "." + node.module if target and node.module else target or node.module or ""
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    deps.add(full if full in mods else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name and d != "ulysses_mcore"}
    return graph


def test_no_import_cycles():
    """The package's modules form a DAG (imports inside functions count too): each layer imports
    only what is below it (e.g. ring -> tiled, never back; checkpoint and pretrain share errors)."""
    graph = _package_imports()
    assert "ulysses_mcore.kernels.tiled" in graph["ulysses_mcore.kernels.ring"]  # the graph sees real edges
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d) :] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def _external_imports(path):
    """Top-level names of the absolute imports in a file (anywhere in it)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add((node.module or "").split(".")[0])
    return names


ROOMS = ("layer", "compat", "trainer")  # the Megatron adapter's rooms, lowest first


def test_megatron_rooms_import_only_rooms_below():
    """layer (what goes in a model) imports neither compat nor trainer; compat (Megatron as
    installed: patches, shims) does not import the trainer."""
    graph = _package_imports()
    for i, room in enumerate(ROOMS):
        above = tuple(f"ulysses_mcore.megatron.{r}." for r in ROOMS[i + 1 :])
        for mod, deps in graph.items():
            if mod.startswith(f"ulysses_mcore.megatron.{room}."):
                up = sorted(d for d in deps if d.startswith(above))
                assert not up, f"{mod} imports {up} from a room above it"


CORE_ROOMS = {  # the attention core's rooms -> the rooms each may import (all may import options)
    "exchange": (),  # head plan, routes, transport, the autograd pair, overlap, token orders
    "kernels": ("exchange",),  # registry, SDPA, flash, TE, varlen, the tiled engine, the ring's walk
    "validation": ("exchange",),  # checks, the compared record, agreements: beside the kernels, not above
}


def _core_modules(graph):
    """The top-level modules and those of the core's rooms."""
    return [m for m in graph if len(p := m.split(".")) == 2 or (len(p) == 3 and p[1] in CORE_ROOMS)]


def test_core_rooms_import_only_what_they_may():
    """The core's rooms: the exchange imports no other room; the kernels and validation import the
    exchange and ``options`` only (validation is off the path from the call to its kernel: what a
    kernel can take lives in ``options``); none imports the call, the public API or the topology."""
    graph = _package_imports()
    for room, may in CORE_ROOMS.items():
        allowed = tuple(f"ulysses_mcore.{r}." for r in (room, *may)) + ("ulysses_mcore.options",)
        mods = [m for m in graph if m.startswith(f"ulysses_mcore.{room}.")]
        assert mods, room
        for mod in mods:
            bad = sorted(d for d in graph[mod] if not d.startswith(allowed))
            assert not bad, f"{mod} imports {bad}, outside {room}'s allowance"


def test_no_kernel_goes_through_the_ring():
    """The ring keeps its walk and merge: only the call (its hybrid path) imports it; the SDPA kernel
    reaches the tiled engine directly."""
    graph = _package_imports()
    users = sorted(m for m, deps in graph.items() if "ulysses_mcore.kernels.ring" in deps)
    assert users == ["ulysses_mcore.call"], users
    assert "ulysses_mcore.kernels.tiled" in graph["ulysses_mcore.kernels.sdpa"]


FLOORS = 7  # the house's floors, each folder of the package drawn as one room


def test_the_house_is_at_most_seven_floors_tall():
    """Each folder of the package (a room: the exchange, kernels, validation, megatron, cli, planning,
    devtools) and each top-level module stands one floor above the highest it imports."""
    graph = _package_imports()
    room = lambda m: ".".join(m.split(".")[:2])  # noqa: E731 - a name for one expression
    rooms = {}
    for mod, deps in graph.items():
        rooms.setdefault(room(mod), set()).update(room(d) for d in deps if room(d) != room(mod))
    floor = {}

    def height(r):
        if r not in floor:
            floor[r] = 1 + max((height(d) for d in rooms.get(r, ())), default=0)
        return floor[r]

    tallest = max(rooms, key=height)
    assert height("ulysses_mcore.validation") == height("ulysses_mcore.kernels")
    assert floor[tallest] <= FLOORS, (
        f"{tallest} stands on floor {floor[tallest]}: {sorted(floor.items(), key=lambda x: x[1])}"
    )


def test_the_core_imports_no_developer_tool():
    """The attention core (the top-level modules and the exchange, kernels and validation rooms) imports
    nothing of ``devtools`` (the fake world, the benchmark harness, process lifetime, flag help); the
    tools may import the core."""
    graph = _package_imports()
    core = _core_modules(graph)
    assert "ulysses_mcore.kernels.tiled" in core and "ulysses_mcore.devtools.fakeworld" in graph
    for mod in core:
        tools = sorted(d for d in graph[mod] if d.startswith("ulysses_mcore.devtools"))
        assert not tools, f"{mod} imports {tools}"


def test_planning_imports_nothing_above_it():
    """planning is arithmetic: no torch, no Megatron, nothing of the package outside planning but the
    layout itself (``topology``: rank math, numpy; the CLI hands planning the trainer's verdict on a
    layout: ``enumerate_layouts(accepts=...)``)."""
    graph = _package_imports()
    assert not _external_imports(ROOT / "ulysses_mcore" / "topology.py") & {"torch", "megatron"}
    for mod, deps in graph.items():
        if mod.startswith("ulysses_mcore.planning."):
            outside = {d for d in deps if not d.startswith("ulysses_mcore.planning") and d != "ulysses_mcore.topology"}
            assert not outside, f"{mod} imports {sorted(outside)}"
            path = ROOT / (mod.replace(".", "/") + ".py")
            assert not _external_imports(path) & {"torch", "megatron", "ulysses_mcore"}, mod


SIZE_BOUNDS = dict(
    nloc=60, ccn=15
)  # per function: lines of code (docstrings and comments aside), cyclomatic complexity
TABLES = {  # argparse tables: data, one branch
    "ulysses_mcore/megatron/trainer/parser.py": {"build_parser"},
    "ulysses_mcore/cli/plan.py": {"build_parser"},
}


def test_functions_are_small():
    """Every function of the package, the tools, the examples and the Megatron-LM patches within the
    bounds (lizard's measure), argparse tables excepted."""
    import lizard

    big = []
    paths = [
        p for d in ("ulysses_mcore", "tools", "examples", "megatron_patches") for p in sorted((ROOT / d).rglob("*.py"))
    ]
    for path in paths:
        rel = str(path.relative_to(ROOT))
        for f in lizard.analyze_file(str(path)).function_list:
            if f.name in TABLES.get(rel, ()):
                continue
            if f.nloc > SIZE_BOUNDS["nloc"] or f.cyclomatic_complexity > SIZE_BOUNDS["ccn"]:
                big.append(f"{rel}:{f.start_line} {f.long_name}: {f.nloc} lines, complexity {f.cyclomatic_complexity}")
    assert not big, f"functions over {SIZE_BOUNDS}: split them into named steps or tables\n" + "\n".join(big)


POSITIONAL_BOUND = 5  # values a call inside the package passes by position; more go by name or in a record
VARARGS = {"save_for_backward"}  # APIs whose arguments are a list by design


def test_no_call_passes_more_than_five_positional_values():
    """Inside the package, a call passes at most five values by position (a starred argument, a list
    the callee takes whole, counts as one): more are named, or travel as one record."""
    import ast

    long = []
    for path in sorted((ROOT / "ulysses_mcore").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or ast.unparse(node.func).split(".")[-1] in VARARGS:
                continue
            if len(node.args) > POSITIONAL_BOUND:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node.func)}: {len(node.args)}")
    assert not long, "calls with more than 5 positional values:\n" + "\n".join(long)


def test_tests_mirror_modules():
    """tests/test_<module>.py for every module of ulysses_mcore/, its core rooms, planning/, devtools/ and megatron/
    rooms, and
    tests/test_cli_<module>.py (test_cli.py for the dispatcher) for its cli/."""
    want = {
        f"test_{p.stem}.py"
        for d in (
            "ulysses_mcore",
            "ulysses_mcore/planning",
            "ulysses_mcore/devtools",
            *(f"ulysses_mcore/{r}" for r in CORE_ROOMS),
            *(f"ulysses_mcore/megatron/{r}" for r in ROOMS),
        )
        for p in (ROOT / d).glob("*.py")
        if p.stem not in ("__init__", "__main__")
    }
    want |= {
        "test_cli.py" if p.stem == "__init__" else f"test_cli_{p.stem}.py"
        for p in (ROOT / "ulysses_mcore/cli").glob("*.py")
    }
    missing = sorted(t for t in want if not (ROOT / "tests" / t).exists())
    assert not missing, f"modules without their test file: {missing}"


def test_every_import_inside_a_function_says_why():
    """Package imports sit at the top of modules; one inside a function carries its reason (an optional
    dependency, a measured start-up cost) on its line, or its group of imports does on the line above."""
    import ast

    bare = []
    for path in sorted((ROOT / "ulysses_mcore").rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    i = node.lineno - 1
                    while i > 0 and lines[i - 1].strip().startswith(("from ", "import ")):
                        i -= 1  # the first import of this group
                    group = lines[i : node.end_lineno]
                    if not any("#" in line for line in group) and not lines[i - 1].strip().startswith("#"):
                        bare.append(f"{path.relative_to(ROOT)}:{node.lineno} {lines[node.lineno - 1].strip()}")
    assert not bare, "imports inside functions without a reason:\n" + "\n".join(bare)


def test_every_public_name_resolves():
    """Each name ``ulysses_mcore`` exports lazily is found in the module its table names."""
    import ulysses_mcore

    for name in ulysses_mcore.__all__:
        assert getattr(ulysses_mcore, name) is not None, name
