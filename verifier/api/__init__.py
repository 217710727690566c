"""The verifier's public face (no torch): request/option/result types, the proto stubs, their
conversion and the one client. The learner imports only this package."""
