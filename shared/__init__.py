"""Code every Magnitude process shares: wire protocol, shm buffers, config, logging, the process runtime."""
