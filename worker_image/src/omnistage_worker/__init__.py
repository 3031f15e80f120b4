"""omnistage worker: serves one model stage and sleeps/wakes it with measured ACKs."""
