"""Fake task: prints "ready" and sleeps until killed (default SIGTERM handling: dies at once)."""
import time

print("ready", flush=True)
while True:
    time.sleep(60)
