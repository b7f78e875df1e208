import sys

from onnx_autodiff.cli import main

sys.exit(main())
