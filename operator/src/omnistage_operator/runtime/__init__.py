"""The process wiring: kopf handlers, group runners, the status publisher, demand watchers,
settings and login."""
