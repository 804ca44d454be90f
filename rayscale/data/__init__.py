"""Shipped default catalog: models.yaml, flavors.yaml, profiles.yaml."""
