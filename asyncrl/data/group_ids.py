"""Training group ids: the one definition of their format, shared by the rollout side that makes them
(asyncrl/rollout/prompts.py) and the buffer that remembers closed groups by them (asyncrl/buffer/store.py).

A training group id is `<run_id>-g<position>` for a prompt's first issue and `<run_id>-g<position>r<retry>`
for its k-th re-issue after the buffer dropped its group unserved; the run id is asyncrl/run_dir.py's.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from asyncrl.run_dir import check_run_id


class GroupKey(NamedTuple):
    """What a training group id says: the run that started it, the prompt position, the retry number."""

    run_id: str
    position: int
    retry: int


def group_id(run_id: str, position: int, retry: int = 0) -> str:
    """The id of a training group: `<run_id>-g<position>`, or `<run_id>-g<position>r<retry>` for a retry."""
    check_run_id(run_id, "group id's run id")
    if position < 0 or retry < 0:
        raise ValueError(f"group position and retry must be >= 0, got position {position}, retry {retry}")
    return f"{run_id}-g{position}" if retry == 0 else f"{run_id}-g{position}r{retry}"


_GROUP_ID = re.compile(r"([0-9a-z]{1,16})-g(0|[1-9][0-9]{0,17})(?:r([1-9][0-9]{0,17}))?")


def parse_group_id(group_id: str) -> GroupKey:
    """The `GroupKey` of a training group id (`PromptDraw.group_id`); ValueError naming it otherwise."""
    m = _GROUP_ID.fullmatch(group_id) if isinstance(group_id, str) else None
    if m is None:
        raise ValueError(f"group id {group_id!r} is not a training group id "
                         f"(<run_id>-g<position> or <run_id>-g<position>r<retry>)")
    return GroupKey(m.group(1), int(m.group(2)), int(m.group(3) or 0))
