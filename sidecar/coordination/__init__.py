"""Fleet-wide admission: N gateway replicas share one admission ledger in Valkey/Redis."""
