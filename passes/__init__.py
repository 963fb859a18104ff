"""autopar package."""
