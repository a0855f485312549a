"""sptransform: graph passes that parallelize an unmodified single-device transformer."""
