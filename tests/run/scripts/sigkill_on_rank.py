"""The rank given as argv[1] SIGKILLs itself; the others wait to be stopped."""
import os
import signal
import sys
import time

if os.environ["RANK"] == sys.argv[1]:
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
