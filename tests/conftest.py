import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Every model the tests generate (grad and the transforms, training artifacts, in this process and
# in the commands it starts) gets onnx.checker's full check with strict shape inference: this is
# what shows that the structural check, the default outside the tests, is enough.
os.environ.setdefault("ONNX_AUTODIFF_CHECK_OUTPUT", "1")

if os.environ.get("ONNX_AUTODIFF_FINGERPRINTS"):  # see tests/fingerprints.py
    import fingerprints
    import pytest

    def pytest_configure(config):
        fingerprints.install(os.environ["ONNX_AUTODIFF_FINGERPRINTS"])

    @pytest.fixture(autouse=True)
    def _fingerprinted(request):
        fingerprints.starting(request.node.nodeid)
        yield
