"""An elastic worker job at run time: its membership decisions, the scale inbox in the run dir, and the supervisor's
hand on its workers."""
