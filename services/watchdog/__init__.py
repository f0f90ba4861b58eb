"""The watchdog: heartbeats every service, restarts dead, hung or bloated ones with backoff, prioritizes inference."""
