"""meshcomm.tools: the command line and everything around the library (bench, demo, tune, drawing, advice); the library never imports it."""
