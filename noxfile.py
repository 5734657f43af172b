"""nox sessions. Torch is pinned to the CPU wheel that pip finds on these machines (`torch==2.13.0`), installed
before the package: never let an install pull a multi-GB CUDA build. On a GPU machine, use scripts/gpu_suite.sh
instead."""

import os
import shutil

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
    """The test suite (on CPU the Triton kernels run in the interpreter; run time: README).

    Installs the `reports` extra too: the harness tests write the plots."""
    _install(session, "test,reports")
    _pytest(session)


def _pytest(session):
    """The suite in `KDA_TEST_WORKERS` workers (default: every core), the interpreter where there is no GPU."""
    workers = os.environ.get("KDA_TEST_WORKERS", "auto")
    session.run("pytest", "-n", workers, "-q", *session.posargs, env=_interpreter_env(session))


# The Triton releases pyproject.toml admits, one per minor version (3.6.0: the GPU machine's); the newest
# is what `nox -s tests` resolves
TRITON_RANGE = ["3.6.0", "3.7.1", "3.8.0", "3.9.0"]


@nox.session
@nox.parametrize("version", TRITON_RANGE)
def tests_triton(session, version):
    """The test suite under each Triton release of the range pyproject.toml admits (`nox -s tests_triton`, or one:
    `nox -s "tests_triton(version='3.7.1')"`): the range is the range tested. Not in CI (four suites' time)."""
    session.install(TORCH_CPU)
    session.install(f"triton=={version}")
    session.install("-e", ".[test,reports]")
    if version.startswith("3.6."):  # its interpreter reads one-element arrays as scalars, which NumPy 2.4 refuses
        session.install("numpy<2.4")
    session.run("python", "-c", f"import triton; assert triton.__version__ == {version!r}, triton.__version__")
    _pytest(session)


@nox.session
def accuracy(session):
    """The accuracy harness, quick preset on CPU (run time: README); `-- --preset full --device cuda` on a GPU.

    Writes accuracy_reports/<preset>-<device>/ (docs/accuracy.md): at unchanged kernels report.json, report.md
    and the plots as committed, meta.json (commit, date, host, run time) rewritten."""
    _install(session, "test,reports")
    session.run("python", "-m", "kda.accuracy", *session.posargs, env=_interpreter_env(session))


@nox.session
def bench(session):
    """The benchmark (needs a GPU; prints times beside fla and the HBM floor; writes the JSON of its rows).
    It lives in benchmarks/, outside the package: it needs fla, which the package does not."""
    _install(session, "test")
    session.run("python", "benchmarks/bench.py", *session.posargs)


# The package session's smoke test, run from outside the checkout: one tiny chunk_kda call (the interpreter on
# CPU) against the float64 oracle, with the kda imported from the installed wheel.
SMOKE = """
import kda, kda_reference, torch
assert "site-packages" in kda.__file__ and "site-packages" in kda_reference.__file__, kda.__file__
gen = torch.Generator().manual_seed(0)
B, T, H, K, V = 1, 24, 1, 16, 16
q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
k = torch.nn.functional.normalize(k, dim=-1)
v = torch.randn(B, T, H, V, generator=gen)
g = -0.5 * torch.rand(B, T, H, K, generator=gen)
beta = torch.rand(B, T, H, generator=gen)
o, s = kda.chunk_kda(q, k, v, g, beta, output_final_state=True)
o64, s64 = kda_reference.recurrent_kda(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                       output_final_state=True, allow_float64=True)
err = max(((o.double() - o64).norm() / o64.norm()).item(), ((s.double() - s64).norm() / s64.norm()).item())
assert err < 1e-5, err
print(f"kda {kda.__file__}: chunk_kda vs kda_reference.recurrent_kda, relative error {err:.1e}")
"""


@nox.session
def package(session):
    """Build the sdist and the wheel (`python -m build`: the wheel is built from the sdist), check what the
    sdist carries (kda, kda_reference, README.md, LICENSE, pyproject.toml; not the tests, which need the
    reports in git), install the wheel into this session's virtualenv (the CPU torch first, then the wheel
    without its dependencies, then triton, and numpy for the Triton interpreter on CPU) and run one tiny
    `kda.chunk_kda` call against the oracle from outside the checkout."""
    session.install("build")
    dist = os.path.join(session.create_tmp(), "dist")
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", dist)
    sdists = [f for f in os.listdir(dist) if f.endswith(".tar.gz")]
    wheels = [f for f in os.listdir(dist) if f.endswith(".whl")]
    assert len(sdists) == 1 and len(wheels) == 1, os.listdir(dist)
    session.run("python", "-c", SDIST_CHECK, os.path.join(dist, sdists[0]))
    session.install(TORCH_CPU)
    session.install("--no-deps", "--force-reinstall", os.path.join(dist, wheels[0]))
    session.install("triton>=3.6,<3.10")
    if "TRITON_INTERPRET" in _interpreter_env(session):
        session.install("numpy")  # the Triton interpreter imports numpy, which triton does not declare
    session.chdir(session.create_tmp())
    session.run("python", "-c", SMOKE, env=_interpreter_env(session))


SDIST_CHECK = """
import sys, tarfile
names = tarfile.open(sys.argv[1]).getnames()
top = {n.split("/")[1] for n in names if n.count("/") >= 1}
expected = {"kda", "kda_reference", "README.md", "LICENSE", "pyproject.toml", "PKG-INFO", ".gitignore"}
assert top == expected, sorted(top ^ expected)
print(f"sdist: {len(names)} entries, top level {sorted(top)}")
"""


@nox.session
def lint(session):
    """ruff check over the repository (the rules are in pyproject.toml)."""
    session.install("ruff")
    session.run("ruff", "check", ".")
