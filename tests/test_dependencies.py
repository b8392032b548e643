"""Every runtime import is declared: the installed command run as a plain ``pip install`` of the
wheel would leave it -- every installed package outside the closure of the wheel's own requirements
(the test extras: pytest, DeepSpeed and what they pull in) hidden from the import system -- trains,
saves and resumes a checkpoint.  The test extras once hid two undeclared imports this way (einops:
Megatron's hierarchical context-parallel groups; psutil: Megatron's checkpoint writer)."""

import os
import subprocess
import sys
import sysconfig
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# what a fresh virtual environment holds by itself
VENV_TOOLS = {"pip", "setuptools", "pkg_resources", "_distutils_hack", "wheel"}
SITE = sorted({os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")})

HIDE = '''
import importlib.machinery, os, sys

HIDDEN = frozenset(os.environ["ULYSSES_MCORE_HIDDEN"].split(","))
SITE = frozenset(os.environ["ULYSSES_MCORE_SITE"].split(os.pathsep))  # where the hidden ones are installed
_PATHS = importlib.machinery.PathFinder


class _DeclaredOnly:
    """sys.path's finder, blind to the hidden packages in site-packages (as if not installed:
    find_spec probes say None); a copy elsewhere on sys.path (a package's vendored one) is found."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if path is None and name in HIDDEN:
            path = [p for p in sys.path if os.path.realpath(p or ".") not in SITE]
        return _PATHS.find_spec(name, path, target)

    @staticmethod
    def invalidate_caches():
        _PATHS.invalidate_caches()


sys.meta_path[:] = [_DeclaredOnly if f is _PATHS else f for f in sys.meta_path]
'''


def declared(root: str = "ulysses-mcore") -> set:
    """The distributions a plain ``pip install`` of ``root`` brings: its requirements without extras,
    and theirs, as installed here (markers evaluated for this interpreter)."""
    seen, todo = set(), [canonicalize_name(root)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in reqs:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def _top_level(dist) -> set:
    """The top-level module names a distribution installs."""
    names = set()
    for f in dist.files or ():
        first = f.parts[0]
        if first.endswith((".dist-info", ".pth")) or first in ("..", "__pycache__"):
            continue
        names.add(first.split(".")[0] if len(f.parts) == 1 else first)
    return names


def hidden_modules(closure: set) -> set:
    """Top-level modules of the distributions installed in this environment's site-packages outside
    ``closure`` (none that a distribution inside it installs too)."""
    kept, out = set(), set()
    for dist in metadata.distributions(path=SITE):
        inside = canonicalize_name(dist.metadata["Name"]) in closure or dist.metadata["Name"] in VENV_TOOLS
        (kept if inside else out).update(_top_level(dist))
    return {m for m in out - kept if m not in sys.stdlib_module_names and m not in VENV_TOOLS}


@pytest.fixture(scope="module")
def plain_env(tmp_path_factory):
    """(environment variables under which every interpreter started sees only the declared packages,
    the declared distributions, the hidden modules)"""
    site = tmp_path_factory.mktemp("plain_site")
    (site / "sitecustomize.py").write_text(HIDE)
    closure = declared()
    hidden = hidden_modules(closure)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, ULYSSES_MCORE_HIDDEN=",".join(sorted(hidden)), OMP_NUM_THREADS="1")
    env["ULYSSES_MCORE_SITE"] = os.pathsep.join(SITE)
    return env, closure, hidden


def test_the_closure_holds_the_runtime_requirements_and_not_the_test_extras(plain_env):
    _, closure, hidden = plain_env
    assert {"torch", "megatron-core", "numpy", "einops", "psutil"} <= closure
    assert not {"pytest", "deepspeed", "hypothesis"} & closure
    assert {"pytest", "deepspeed"} <= hidden


def test_a_hidden_package_fails_to_import(plain_env):
    env = plain_env[0]
    code = "import torch, megatron.core, einops, psutil\n"
    code += "try:\n    import pytest\nexcept ImportError as e:\n    print(e)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "No module named 'pytest'"


@pytest.mark.slow
def test_a_ring_layout_trains_saves_and_resumes_with_the_declared_packages_only(plain_env, tmp_path):
    env = plain_env[0]
    ckpt = tmp_path / "ckpt"
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    run += ["-m", "ulysses_mcore", "pretrain", "--ulysses-degree", "2", "--context-parallel-size", "2"]
    run += ["--reset-attention-mask", "--train-iters", "4", "--lr-warmup-iters", "0", "--log-interval", "1"]
    kw = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    first = subprocess.run([*run, "--save", str(ckpt), "--save-interval", "2", "--exit-interval", "2"], **kw)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "successfully saved checkpoint from iteration       2" in first.stdout
    resumed = subprocess.run([*run, "--load", str(ckpt)], **kw)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "successfully loaded checkpoint" in resumed.stdout
    assert "iteration        4/       4" in resumed.stdout
