"""The package passes its linter and its type checker (pyproject's [tool.ruff] and [tool.mypy]:
strict on the public surface and the options, basic elsewhere), and its public functions have
explicit signatures."""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MYPY_CACHE_DIR": os.environ.get("MYPY_CACHE_DIR", "/tmp/raydist-mypy")})


@pytest.mark.timeout(120)
def test_ruff_finds_nothing_in_the_package():
    done = _run("ruff", "check", "raydist")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.timeout(600)
def test_mypy_finds_nothing_in_the_package():
    done = _run("mypy")  # files, strictness: pyproject.toml
    assert done.returncode == 0, done.stdout + done.stderr


def test_public_functions_and_classes_take_no_var_keyword_arguments():
    """Every keyword a public call takes is in its signature (IDEs and help() show it)."""
    import raydist

    hidden = []
    for name in raydist.__all__:
        obj = getattr(raydist, name)
        calls = [obj] if inspect.isfunction(obj) else [obj.__init__, *[
            m for n, m in vars(obj).items() if inspect.isfunction(m) and not n.startswith("_")]] \
            if inspect.isclass(obj) else []  # fmt: skip
        for call in calls:
            if not (getattr(call, "__module__", None) or "").startswith("raydist"):
                continue  # inherited (an exception's from BaseException)
            kinds = {p.kind for p in inspect.signature(call).parameters.values()}
            if inspect.Parameter.VAR_KEYWORD in kinds:
                hidden.append(f"{name}.{call.__name__}")
    assert not hidden, hidden


def test_to_static_takes_every_keyword_distmodel_takes_with_the_same_defaults():
    import raydist

    model = {n: p.default for n, p in inspect.signature(raydist.DistModel.__init__).parameters.items()
             if n != "self"}  # fmt: skip
    made = {n: p.default for n, p in inspect.signature(raydist.to_static).parameters.items()}
    assert made == model


# Where the driver may call an actor (`.remote(`): the one function that calls a rank actor
# (`call_on`, beside starting one), the transports that send steps, and the small client of each
# other actor. Anywhere else a rank call is `RankGroup.call`/`tell` or `RankClient`'s.
REMOTE_CALLS = {
    "raydist/driver/cluster/config.py": {"call_on", "call_each_on", "start_actor", "_remote"},
    "raydist/driver/dispatch/transport.py": {"CallTransport", "TreeTransport"},
    "raydist/driver/lifecycle/peers.py": {"KeeperClient", "PeerMemory._keeper"},
    "raydist/driver/lifecycle/detached.py": {"RecordClient", "Hold.create", "_record_class"},
    "raydist/driver/cluster/state.py": {"ReaderClient", "_reader_class"},
    "raydist/driver/watching/metrics.py": {"RelayClient", "_relay_class"},
    "raydist/testing.py": {"on_ranks"},  # for tests: a function run in each rank's process
}


def test_the_driver_calls_actors_only_through_their_clients():
    import ast

    found = []
    for path in sorted((ROOT / "raydist").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where.startswith(("raydist/worker/", "raydist/compat/")) or where in ("raydist/protocol.py",
                                                                                 "raydist/handover.py"):
            continue  # rank-side code: ranks call keepers and each other
        tree = ast.parse(path.read_text())

        def visit(node, scope):
            for child in ast.iter_child_nodes(node):
                inner = scope + [child.name] if isinstance(child, (ast.FunctionDef, ast.ClassDef)) else scope
                if isinstance(child, ast.Attribute) and child.attr == "remote":
                    allowed = REMOTE_CALLS.get(where, set())
                    if not any(".".join(scope[:i]) in allowed for i in range(1, len(scope) + 1)):
                        found.append(f"{where}:{child.lineno} in {'.'.join(scope) or 'the module'}")
                visit(child, inner)

        visit(tree, [])
    assert not found, found
