<?php

/**
 * scripts/bench's task class that does nothing: what a PHP-only class costs around
 * the work. Copied into the bench's scratch copy's src/extensions/ only; never into
 * a Phorge that serves anyone.
 */
final class PhorgeBridgeBenchNoopWorker extends PhabricatorWorker {

  protected function doWork() {
    return;
  }

}
