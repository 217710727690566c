"""What the two processes of a check share (no candidate or checker logic): the framed channel, the
records they exchange and the shared-memory tensor exchange."""
