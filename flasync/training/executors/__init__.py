"""Where training runs: worker threads or Ray actors, behind one executor Protocol."""
