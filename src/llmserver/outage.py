"""An outage of something the gateway depends on (the database, Redis), logged once when it starts
and once when it ends, never once per request or per retry that meets it."""

from __future__ import annotations

import logging


class Outage:
    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self.down = False

    def failed(self, message: str, *args: object, level: int = logging.ERROR) -> None:
        if not self.down:
            self.down = True
            self._log.log(level, message, *args)

    def recovered(self, message: str, *args: object) -> bool:
        """True (and the message logged) when this ends an outage."""
        if not self.down:
            return False
        self.down = False
        self._log.info(message, *args)  # a recovery is good news: the outage itself was the warning
        return True


def redis_unreachable() -> tuple[type[BaseException], ...]:
    """The errors that mean Redis cannot be reached (its client is imported only when Redis is used)."""
    import redis.exceptions

    return (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
