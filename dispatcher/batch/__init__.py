"""The batch runner: a batch file's lines released into spare slots, collected
and written back (docs/batch.md). ``runner`` is the loop, the rest its parts."""
