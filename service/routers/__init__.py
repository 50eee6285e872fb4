"""One router per resource; ``service.main`` includes them all."""
