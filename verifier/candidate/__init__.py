"""What runs in the untrusted processes: the fork server, its worker, and the candidate runner. Never
imported by the checker (``verifier.check``) or the service (``verifier.serve``)."""
