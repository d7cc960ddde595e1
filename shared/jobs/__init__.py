"""Jobs: submission, the lease, queue names, the broker, and sweeps that submit in bulk."""
