"""Files on disk: bounded reads, atomic writes, tensor files, one commit primitive."""
