"""Routing: which Celery queue serves a task class (ordered glob rules, then a default)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

QUEUE_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")
QUEUE_NAME_RULE = "letters, digits and _ . : -"

Rule = tuple[str, str]  # (glob of task classes, queue)


def parse_queue_name(text: str) -> str:
    """A queue name as given; raises ValueError for one a broker may not accept."""
    if not QUEUE_NAME.match(text):
        raise ValueError(f"malformed queue name {text!r}; use {QUEUE_NAME_RULE}")
    return text


def parse_rules(text: str) -> tuple[Rule, ...]:
    """Parse ``'PhabricatorSearchWorker=search,*Mail*=mail'``; raises ValueError."""
    rules = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        pattern, sep, queue = (s.strip() for s in part.partition("="))
        if not sep or not pattern or not QUEUE_NAME.match(queue):
            raise ValueError(
                f"malformed rule {part!r}; expected 'glob=queue' with a queue name of "
                f"{QUEUE_NAME_RULE}"
            )
        rules.append((pattern, queue))
    return tuple(rules)


@dataclass(frozen=True)
class Router:
    """Ordered ``(glob, queue)`` rules; the first rule matching a class wins."""

    rules: tuple[Rule, ...]
    default_queue: str

    def queue_for(self, task_class: str) -> str:
        for pattern, queue in self.rules:
            if fnmatchcase(task_class, pattern):
                return queue
        return self.default_queue

    def routed(self, task_class: str) -> bool:
        """Whether a rule names the class: the operator declared that the workers of its
        queue serve it (they may all be scaled to zero now)."""
        return any(fnmatchcase(task_class, pattern) for pattern, _ in self.rules)

    @property
    def queues(self) -> list[str]:
        """Every queue a task may be routed to, in rule order, the default last."""
        names = dict.fromkeys(queue for _, queue in self.rules)
        names[self.default_queue] = None
        return list(names)
