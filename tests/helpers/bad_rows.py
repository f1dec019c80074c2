"""Rows Phorge's PHP can leave behind but a careful writer never would."""

from __future__ import annotations

from sqlalchemy import insert, update

from bridge.queue import PhorgeQueue
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_taskdata as taskdata

SURROGATE = b'{"text": "\xed\xa0\x80"}'  # a UTF-8-encoded lone surrogate: MariaDB keeps it


def corrupt_data(q: PhorgeQueue, task_id: int) -> None:
    """Give ``task_id`` a data row a UTF-8 connection cannot decode, as MariaDB allows."""
    with q.engine.begin() as conn:
        data_id = conn.execute(insert(taskdata).values(data="{}")).inserted_primary_key[0]
        conn.exec_driver_sql(
            "UPDATE worker_taskdata SET data = %s WHERE id = %s", (SURROGATE, data_id)
        )
        conn.execute(update(active).where(active.c.id == task_id).values(dataID=data_id))
