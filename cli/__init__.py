"""The `shoal` command: run the services (`shoal up`, one at a time), look at the cluster
(`shoal status`, `shoal inspect`), change it (`shoal scale`, `shoal evict`), make the demo models."""
