"""kubelet device plugin (v1beta1): discovery, health, allocation, CDI, registration."""
