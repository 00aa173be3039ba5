"""What requests bring in from outside: fetched URLs (and, later, images and documents)."""
