"""Optional packages: a feature whose package is missing fails in one line naming the extra, before the long
work starts; the base install brings what `serve` needs; the dev extra brings every package the tests import."""
import ast
import sys
from pathlib import Path

import pytest
import torch

from pagedmoe.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _hide(monkeypatch, *modules):
    for name in modules:  # a None entry makes import (and find_spec) treat the package as absent
        monkeypatch.setitem(sys.modules, name, None)


def _no_engine(monkeypatch):
    from pagedmoe.engine import llm_engine

    def refuse(*_args, **_kwargs):
        raise AssertionError("the engine was built before the missing package was noticed")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", refuse)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_eval_plot_without_matplotlib_fails_first(monkeypatch, capsys, tmp_path):
    _hide(monkeypatch, "matplotlib")
    _no_engine(monkeypatch)
    assert main(["eval", "--device", "cpu", "--plot", str(tmp_path / "u.png"),
                 "--output-json", str(tmp_path / "e.json")]) == 2
    err = _one_line(capsys)
    assert "eval --plot" in err and "'matplotlib'" in err and "pagedmoe[plot]" in err


def test_sweep_plots_without_matplotlib_fail_first(monkeypatch, capsys, tmp_path):
    _hide(monkeypatch, "matplotlib")
    _no_engine(monkeypatch)
    assert main(["bench", "sweep", "--device", "cpu", "--budgets", "1", "--output-dir", str(tmp_path)]) == 2
    err = _one_line(capsys)
    assert "--no-plots" in err and "pagedmoe[plot]" in err
    assert not (tmp_path / "sweep.json").exists()


def test_cuda_without_triton_names_the_gpu_extra(monkeypatch):
    from pagedmoe.engine.startup import check_gpu_packages as _check_gpu_packages
    from pagedmoe.extras import MissingPackageError

    _check_gpu_packages(torch.device("cpu"))  # the CPU needs no kernels of ours
    _hide(monkeypatch, "triton")
    _check_gpu_packages(torch.device("cpu"))
    with pytest.raises(MissingPackageError, match=r"CUDA device needs the 'triton' package.*pagedmoe\[gpu\]"):
        _check_gpu_packages(torch.device("cuda"))


def test_require_names_the_pypi_package():
    from pagedmoe.extras import MissingPackageError, has_package, require

    assert has_package("torch") and not has_package("no_such_pkg_pagedmoe.sub")
    with pytest.raises(MissingPackageError, match=r"--expert-buffers vmm needs the 'cuda-python' package.*"
                                                   r"scripts/install.sh gpu"):
        require("no_such_pkg_pagedmoe.bindings", "gpu", "--expert-buffers vmm", package="cuda-python")


def _declared() -> tuple[set, set]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs):
        return {r.split(";")[0].split(">")[0].split("=")[0].split("[")[0].strip().lower().replace("_", "-")
                for r in reqs}

    extras = project["optional-dependencies"]
    # the gpu extra's packages are imported only on a CUDA device (GPU tests)
    return names(project["dependencies"]), names(extras["dev"]) | names(extras["gpu"])


# import name -> PyPI name, where they differ
_PYPI = {"yaml": "pyyaml", "prometheus_client": "prometheus-client", "cuda": "cuda-python", "pynvml": "nvidia-ml-py"}
# installed with another package listed (torch brings these; fastapi brings starlette, anyio, pydantic's core)
_BROUGHT = {"starlette", "anyio", "triton"}


def _imports(paths) -> set:
    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def test_every_imported_package_is_installed_by_the_project():
    """What tests/, src/ and the benchmark scripts the tests run import is in the base install or the dev extra
    (`.ci/run` installs `.[dev]`): a package that passes only where someone installed it by hand is caught."""
    local = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    local |= {"pagedmoe", "__future__"}
    paths = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "src").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    third_party = {m for m in _imports(paths) if m not in sys.stdlib_module_names and m not in local}
    base, dev = _declared()
    missing = sorted(m for m in third_party
                     if _PYPI.get(m, m).replace("_", "-") not in base | dev and m not in _BROUGHT)
    assert not missing, f"imported but installed by nothing in pyproject.toml: {missing}"
    assert {"fastapi", "uvicorn", "pydantic", "prometheus-client"} <= base  # `serve` after the base install
