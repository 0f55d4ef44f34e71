"""The inference engine of one replica: pure Python policy (sequence, kv_cache, scheduler) and the
torch side (runner, sampling). Imports nothing from Django, Channels, Celery or our apps."""
