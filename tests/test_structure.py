"""The code's shape (issue 40, item 4), read from the source with `ast`: no import cycle among
jpaged/, serving/ and pallas_kernels/ (module-level, function-local and TYPE_CHECKING imports
alike), no source file over 500 lines, and no `id(...)` call in jpaged/ or serving/ (state keyed
by object ids breaks when an object dies and its id is reused). And what the engine works out
per request stays out of the user's SamplingParams."""

import ast
import copy
import json
import pathlib

import pytest

from jpaged.core.request_needs import RequestNeeds
from jpaged.core.sequence import Sequence, SequenceGroup
from jpaged.core.structured_output import MAX_CACHED_GUIDES, StructuredOutputManager, guide_of
from jpaged.sampling_params import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jpaged", "serving", "pallas_kernels")
MAX_LINES = 500


def modules(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's __init__)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def imported(name: str, path: pathlib.Path, is_package: bool, known) -> set[str]:
    """The modules of `known` that importing `name` runs, by every import statement in it (at
    module level, in functions, under TYPE_CHECKING): `import a.b` and `from a.b import c` import
    a.b, or a.b.c when that is a module (then a.b's names are not read), and the packages above
    it (their __init__ run first) except those `name` is inside (Python already has them, half-run,
    when `name` runs: only a name read from one of them makes a cycle)."""
    package = name if is_package else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, `level - 1` packages up
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                # `from a.b import c` where c is a module imports a.b.c (and a.b, its package).
                targets.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    out = {target for target in targets if target in known and target != name}
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts)):
            package = ".".join(parts[:i])
            if package in known and package != name and not name.startswith(package + "."):
                out.add(package)
    return out


def import_graph(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    known = modules(root, packages)
    return {name: imported(name, path, is_package, known) for name, (path, is_package) in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as its modules in import order (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def id_calls(path: pathlib.Path) -> list[int]:
    """Lines of the file's calls of the builtin id()."""
    tree = ast.parse(path.read_text(), str(path))
    return sorted(node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "id")


# ------------------------------------------------------------------ the checks on this repository

def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_file_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for d in PACKAGES + ("scripts",) for p in sorted((ROOT / d).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_no_id_calls():
    files = [p for d in ("jpaged", "serving") for p in sorted((ROOT / d).rglob("*.py"))]
    calls = {str(p.relative_to(ROOT)): lines for p in files if (lines := id_calls(p))}
    assert not calls, f"id() calls (file: lines): {calls}"


# ------------------------------------------------------------------ the checks themselves

def write(root: pathlib.Path, files: dict[str, str]):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.mark.parametrize("files, cycle", [
    # module level
    ({"p/__init__.py": "", "p/a.py": "from p.b import x\n", "p/b.py": "import p.a\n"}, ["p.a", "p.b", "p.a"]),
    # function-local and relative, through a package's __init__
    ({"p/__init__.py": "from p.a import f\n", "p/a.py": "def f():\n    from . import q\n",
      "p/q/__init__.py": "", "p/q/m.py": "from p import f\n"}, None),
    ({"p/__init__.py": "", "p/a.py": "def f():\n    from .q import m\n",
      "p/q/__init__.py": "", "p/q/m.py": "from ..a import f\n"}, ["p.a", "p.q.m", "p.a"]),
    # TYPE_CHECKING only
    ({"p/__init__.py": "", "p/a.py": "import typing\nif typing.TYPE_CHECKING:\n    from p.b import B\n",
      "p/b.py": "from p.a import A\n"}, ["p.a", "p.b", "p.a"]),
    # a module importing a name of its own package's __init__ that imports it: a cycle ...
    ({"p/__init__.py": "from p.a import f\n", "p/a.py": "from p import g\n"}, ["p", "p.a", "p"]),
    # ... but not a submodule by `from p import sub` (that runs only p.sub beyond what is running)
    ({"p/__init__.py": "from p.a import f\n", "p/a.py": "from p import b\n", "p/b.py": ""}, None),
    # a package's __init__ run by importing one of its modules from outside it
    ({"p/__init__.py": "from p.a import f\n", "p/a.py": "import r.m\n", "r/__init__.py": "import p.a\n",
      "r/m.py": ""}, ["p", "p.a", "r", "p"]),
])
def test_find_cycle_on_made_up_packages(tmp_path, files, cycle):
    write(tmp_path, files)
    packages = sorted({rel.split("/")[0] for rel in files})
    assert find_cycle(import_graph(tmp_path, packages)) == cycle


def test_id_calls_finds_the_builtin_only(tmp_path):
    write(tmp_path, {"m.py": "d = {id(x): x for x in xs}\nseq_id(1)\nobj.id(2)\n\n\ndef f():\n    return id(f)\n"})
    assert id_calls(tmp_path / "m.py") == [1, 7]


# ------------------------------------------------------------------ the user's SamplingParams stay theirs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/b"}},
          "required": ["a"], "$defs": {"b": {"type": "array", "items": {"type": "string"}}}}


@pytest.mark.parametrize("params, needs", [
    # (host_tokens, full_sampler, speculate, grammar), by hand: the host needs each token before
    # the next plan for beams; a grammar needs it before the next sampling only (its masks);
    # penalties (the device's token history) and logprobs need the full sampler only; forks and
    # beams do not speculate.
    (dict(), (False, False, True, False)),
    (dict(logprobs=2), (False, True, True, False)),
    (dict(presence_penalty=0.5), (False, True, True, False)),
    (dict(guided_json=SCHEMA), (False, True, True, True)),
    (dict(n=2, temperature=1.0), (False, False, False, False)),
    (dict(use_beam_search=True, best_of=2, temperature=0.0), (True, True, False, False)),
])
def test_request_needs_live_on_the_group_not_in_the_params(params, needs):
    sp = SamplingParams(**params)
    before = copy.deepcopy(vars(sp))
    group = SequenceGroup("r", [Sequence(0, [1, 2, 3])], sp, 0.0)
    assert group.needs == RequestNeeds(*needs)
    assert vars(sp) == before


def test_guides_are_kept_by_the_manager_not_in_the_params():
    manager = StructuredOutputManager(None, vocab_size=100)
    sp = SamplingParams(guided_json=SCHEMA)
    before = copy.deepcopy(vars(sp))
    guide = manager.guide(sp)
    assert guide == guide_of(sp) and vars(sp) == before
    # Another request with the same grammar finds it; another grammar gets its own.
    assert manager.guide(SamplingParams(guided_json=copy.deepcopy(SCHEMA))) is guide
    assert manager.guide(SamplingParams(guided_json=json.dumps(SCHEMA))) == guide_of(SamplingParams(
        guided_json=json.dumps(SCHEMA)))
    other = {**SCHEMA, "required": ["a", "b"]}
    assert manager.guide(SamplingParams(guided_json=other)) == guide_of(SamplingParams(guided_json=other)) != guide
    assert manager.guide(SamplingParams(guided_regex="[ab]+")) == ("guided_regex", "[ab]+")
    assert manager.guide(SamplingParams(guided_choice=["x", "y"])) == ("guided_choice", ("x", "y"))
    assert manager.guide(SamplingParams()) is None
    # Bounded: the least recently used go first.
    for i in range(MAX_CACHED_GUIDES):
        manager.guide(SamplingParams(guided_regex=f"r{i}"))
    assert manager.guide(SamplingParams(guided_json=SCHEMA)) is not guide
    assert manager.guide(SamplingParams(guided_json=SCHEMA)) == guide
