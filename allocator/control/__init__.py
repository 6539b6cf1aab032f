"""Control plane: the policy bundle distributed through etcd (seed ch. 14)."""
