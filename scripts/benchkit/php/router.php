<?php

/**
 * phorge-bridge's scripts/bench: the router of its web tier, `php -S ... router.php`,
 * doing what a web server's rewrite rule does for Phorge (as the tests' router).
 * One path of its own, /__bench/opcache, answers opcache_get_status() of the
 * worker that serves it, so the bench can say whether opcache was on.
 */
$path = parse_url($_SERVER['REQUEST_URI'], PHP_URL_PATH);
if ($path === '/__bench/opcache') {
  header('Content-Type: application/json');
  $status = function_exists('opcache_get_status') ? @opcache_get_status(false) : false;
  $stats = is_array($status) ? $status['opcache_statistics'] : array();
  echo json_encode(array(
    'sapi' => PHP_SAPI,
    'pid' => getmypid(),
    'enabled' => is_array($status) && !empty($status['opcache_enabled']),
    'scripts' => isset($stats['num_cached_scripts']) ? $stats['num_cached_scripts'] : 0,
    'hits' => isset($stats['hits']) ? $stats['hits'] : 0,
    'misses' => isset($stats['misses']) ? $stats['misses'] : 0,
  ));
  return true;
}
$_GET['__path__'] = $path;
$_REQUEST['__path__'] = $path;
// Cluster mode insists on it; php -S does not set it.
if (!isset($_SERVER['SERVER_ADDR'])) {
  $_SERVER['SERVER_ADDR'] = '127.0.0.1';
}
require getenv('PHORGE_WEBROOT').'/index.php';
