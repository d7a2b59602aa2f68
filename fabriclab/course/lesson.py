"""Helpers shared by the lesson notebooks, one name space for a notebook's ``lesson.X``:

* ``fabriclab.course.showing``: ``show_source(obj)`` / ``show_diff(old, new)`` (a stage's code, and what changed
  since the previous stage, straight from the modules: the library is the single source of truth), ``fabric()`` /
  ``stage_args()`` (which provider and domain a lesson runs on; IP-based providers pinned to the loopback
  interface), ``LocalPair`` (two endpoints in one process, with a ``Trace`` of posts and completions);
* ``fabriclab.course.chapters``: chapters 9-16 measured (lesson 09 explains them): ``interleaved`` runs with
  ``spread``/``verdict``, per-write counters, each chapter's mechanism, checked facts (``fact``, ``not_shown``,
  ``check``) and the reader's figure beside the article's and a recorded larger machine's;
* ``fabriclab.course.loops``: loops a reader builds against the modeled p5 (``ModelNics``; ``posting_loop``,
  chapters 14 and 15's loop with its calls counted).
"""
from .chapters import *  # noqa: F401,F403
from .loops import *  # noqa: F401,F403
from .showing import *  # noqa: F401,F403
