"""The io engine: io_uring and its fallback, the pinned pool, checksums, own files, tuning."""
