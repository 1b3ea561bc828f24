import sys

try:
    from workbench.cli import main
except KeyboardInterrupt:  # Ctrl-C while the interpreter imports the package: no traceback, the usual code
    sys.exit(130)

sys.exit(main())
