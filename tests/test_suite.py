"""The test suite's own settings (pytest.ini)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_failed_test_that_compiled_shows_its_assertion_without_torch_trace_lines(tmp_path):
    """torch keeps its structured-trace logger torch.__trace at DEBUG and pytest captures loggers
    that do not propagate: without pytest.ini's log_level every compile added ~60 empty
    `DEBUG torch.__trace` lines to a failure's report. Dynamo writes them whatever the backend
    (34 here with the eager one, which spares the test a C++ build)."""
    test = tmp_path / "test_compiles_then_fails.py"
    test.write_text("import torch\n\n\ndef test_it():\n"
                    "    torch.compile(lambda x: x.sin(), backend='eager', dynamic=False)(torch.ones(3))\n"
                    "    assert 1 == 2, 'the assertion itself'\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pytest.ini"), "--rootdir", str(tmp_path),
                           "-n", "0", "-p", "no:cacheprovider", str(test)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert done.returncode == 1 and "the assertion itself" in done.stdout, done.stdout[-2000:]
    assert "torch.__trace" not in done.stdout + done.stderr
