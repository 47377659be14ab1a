"""Resuming the loader, one room with one entry point: ``stream_loader.py`` imports from here alone.

``state`` holds the saved state (its keys and versions, :class:`Resumed`,
:class:`LoaderStateError`); its two readers stand on it: ``same_job`` continues one rank's
own state batch for batch, ``elsewhere`` continues every rank's states of a job of another
size or mix from what that job left unread.
"""

from melcache.loader.resume.elsewhere import resume_elsewhere, saved_deals, stream_keys
from melcache.loader.resume.same_job import STATE_VERSION, restore, state_identity
from melcache.loader.resume.state import ELASTIC_VERSIONS, LoaderStateError, Resumed, state_cut

__all__ = [
    "ELASTIC_VERSIONS",
    "STATE_VERSION",
    "LoaderStateError",
    "Resumed",
    "restore",
    "resume_elsewhere",
    "saved_deals",
    "state_cut",
    "state_identity",
    "stream_keys",
]
