"""Fake task: ignores SIGTERM, prints "ready", and sleeps until SIGKILLed."""
import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(60)
