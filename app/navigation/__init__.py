"""The window's left navigation rail and the icons it paints."""
