<?php

/**
 * phorge-bridge's scripts/bench: a task class that does nothing, so that the
 * bench measures what running a PHP-only class costs (the queue, the process
 * around it), not the work. The bench copies this file into the
 * src/extensions/ of its own scratch copy of Phorge (Phorge loads that
 * directory's files itself, no library map needed) and removes it afterwards.
 * Never install it into a Phorge that serves anyone.
 */
final class PhorgeBridgeBenchNoopWorker extends PhabricatorWorker {

  protected function doWork() {
    return;
  }

}
