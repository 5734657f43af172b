"""nox sessions. Torch is pinned to the CPU wheel that pip finds on these machines (`torch==2.13.0`):
never let an install pull a multi-GB CUDA build. On a GPU machine, use scripts/gpu_suite.sh instead."""

import os

import nox

nox.options.default_venv_backend = "virtualenv"  # pip, not uv: uv does not see the local CPU torch wheel
nox.options.sessions = ["tests"]

TORCH_CPU = "torch==2.13.0"


def _install(session, extras):
    session.install(TORCH_CPU)
    session.install("-e", f".[{extras}]")


def _interpreter_env(session) -> dict:
    env = {}
    has_cuda = session.run("python", "-c", "import torch; print(int(torch.cuda.is_available()))",
                           silent=True).strip().endswith("1")
    if not has_cuda:
        env["TRITON_INTERPRET"] = "1"
    return env


@nox.session
def tests(session):
    """The test suite (on CPU the Triton kernels run in the interpreter), about 6 min on 2 cores.

    Installs the `reports` extra too: the harness tests write the plots."""
    _install(session, "test,reports")
    workers = os.environ.get("KDA_TEST_WORKERS", "auto")
    session.run("pytest", "-n", workers, "-q", *session.posargs, env=_interpreter_env(session))


@nox.session
def accuracy(session):
    """The accuracy harness, quick preset on CPU (about 8 min on 2 cores); `-- --preset full --device cuda` on a GPU.

    Writes accuracy_reports/<preset>-<device>/ (docs/accuracy.md)."""
    _install(session, "test,reports")
    session.run("python", "-m", "kda.accuracy", *session.posargs, env=_interpreter_env(session))


@nox.session
def bench(session):
    """The benchmark (needs a GPU; prints times beside fla and the HBM floor; writes the JSON of its rows).
    It lives in benchmarks/, outside the package: it needs fla, which the package does not."""
    _install(session, "test")
    session.run("python", "benchmarks/bench.py", *session.posargs)


@nox.session
def lint(session):
    """ruff check over the repository (the rules are in pyproject.toml)."""
    session.install("ruff")
    session.run("ruff", "check", ".")
