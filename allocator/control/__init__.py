"""Control plane: the policy bundle distributed through etcd."""
