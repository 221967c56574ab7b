"""``python -m skorch_accel_callbacks list|verify|export ...``: see
:mod:`skorch_accel_callbacks.tools.cli`."""

import sys

from skorch_accel_callbacks.tools.cli import main

if __name__ == '__main__':
    sys.exit(main(prog='python -m skorch_accel_callbacks'))
