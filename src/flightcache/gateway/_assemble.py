"""The gateway's view of stored chat chunks; the code lives with the SDK wrappers, which
assemble the same answers (``flightcache.integrations._chat``)."""

from ..integrations._chat import assemble, chunks_from_completion, for_client, mark_cached

__all__ = ["assemble", "chunks_from_completion", "for_client", "mark_cached"]
