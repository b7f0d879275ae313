import signal
import sys


def _terminated(signum, frame):
    # SIGTERM before a command installs its own handling (the server's graceful drain, the daemon's cleanup) is a
    # request to stop: a clean exit 0, not death by signal mid-import.
    raise SystemExit(0)


signal.signal(signal.SIGTERM, _terminated)
try:
    from warmstart.cli import main
    code = main()
except KeyboardInterrupt:               # Ctrl-C while still importing: no traceback
    code = 130
sys.exit(code)
